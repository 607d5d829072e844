"""Where the CLI prints: results on stdout, warnings and errors on stderr."""

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # paths stay on one line, greppable
