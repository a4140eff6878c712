"""`python -m launcher` is the `pretrain` command."""

from launcher.cli import main

if __name__ == "__main__":
    main()
