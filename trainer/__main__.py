"""``python -m trainer <verb>``: the command line. Exit codes: 0 done, 1 failure, 2 bad input, 130/143 signal."""

from trainer.cli import main

raise SystemExit(main())
