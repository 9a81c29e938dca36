"""`python -m pipelaunch ...`: the same as the `pipelaunch` command."""

from pipelaunch.cli import main

if __name__ == "__main__":
    main()
