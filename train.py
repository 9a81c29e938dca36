"""Entry point in a checkout: `python train.py scheduler=zbv pp=4 dp=2` (see README.md). The same
as the installed `pipelaunch` command (`pipelaunch/cli.py`)."""

from pipelaunch.cli import main

if __name__ == "__main__":
    main()
