"""File-format readers: each turns a file or folder into a config and checked weight sources."""
