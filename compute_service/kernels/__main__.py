from compute_service.kernels import main

main()
