"""``python -m llaisys``: the same as the ``llaisys`` command."""
from .cli.main import main

raise SystemExit(main())
