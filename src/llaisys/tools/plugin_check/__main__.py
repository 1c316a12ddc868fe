"""``python -m llaisys.tools.plugin_check PATH``."""
from .cli import main

raise SystemExit(main())
