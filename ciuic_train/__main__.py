from ciuic_train.cli import main

main()
