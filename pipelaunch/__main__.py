"""`python -m pipelaunch ...`: the same as the `pipelaunch` command."""

from pipelaunch.cli import main

main()
