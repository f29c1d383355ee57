"""Layer 8, the command line: the parser and its subcommands, TrainConfig's options, what a command takes from an
adapter's run."""
