from compute_service.attention.native import main

main()
