from compute_service.server import main

main()
