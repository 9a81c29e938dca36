"""Entry point in a checkout: `python train.py scheduler=zbv pp=4 dp=2` (see README.md). The same
as the installed `pipelaunch` command (`pipelaunch/cli.py`)."""

if __name__ == "__main__":
    # imported here, not above: a spawned rank imports this file again (as `__mp_main__`) and
    # needs none of the launcher
    from pipelaunch.cli import main

    main()
