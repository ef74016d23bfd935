from cache_service.server import main

main()
