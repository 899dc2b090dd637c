"""``python -m kcloak``: the ``kcloak`` command line; child processes start as
``[sys.executable, "-I", "-m", "kcloak", ...]`` (isolated: the current folder cannot shadow kcloak)."""

from kcloak.cli.main import main

raise SystemExit(main())
