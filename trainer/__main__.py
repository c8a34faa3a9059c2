"""``python -m trainer <verb>``: the command line. Exit codes: 0 done (also: a finished run left as is),
1 failure, 2 bad input, 3 a plan refused for a folder that holds a run, 130/143 stopped by a signal,
141 stdout closed by its reader (``| head``)."""

from trainer.cli import main

raise SystemExit(main())
