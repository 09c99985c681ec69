from ciuic_train.cli.main import main

main()
