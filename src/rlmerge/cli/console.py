"""Where the CLI prints: results on stdout, warnings and errors on stderr.

Both consoles read Rich markup (``[bold]…[/]``), so every text that is not markup (a path, a label, an error's
message, a hint such as ``pip install 'rlmerge[ray]'``) goes through ``escape`` first: Rich would take
``[ray]`` for a tag and print ``pip install 'rlmerge'``.
"""

from rich.console import Console
from rich.markup import escape

__all__ = ["err", "escape", "out"]

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # paths stay on one line, greppable
