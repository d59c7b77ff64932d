from gemmactl.cli import main

main()
