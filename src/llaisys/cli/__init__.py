"""The ``llaisys`` command line: one module per sub-command, each exposing ``register(subparsers)``."""
