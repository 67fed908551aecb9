from torchcal.experiments.cli import main

main()
