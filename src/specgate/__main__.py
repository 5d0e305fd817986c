from specgate.cli.main import main

main()
