from qtool.cli import main

main()
