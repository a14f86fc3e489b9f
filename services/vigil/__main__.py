from vigil.cli import main

main()
