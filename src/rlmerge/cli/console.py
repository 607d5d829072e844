"""Where the CLI prints: results on stdout, warnings and errors on stderr.

Both consoles read Rich markup (``[bold]…[/]``), so every text that is not markup (a path, a label, an error's
message, a hint such as ``pip install 'rlmerge[ray]'``) goes through ``escape`` first: Rich would take
``[ray]`` for a tag and print ``pip install 'rlmerge'``.
"""

from rich.console import Console
from rich.markup import escape

__all__ = ["err", "escape", "out"]

# Soft wrap: a line longer than the terminal is left for the terminal to fold, not broken by Rich at a space, so a
# path or a label in a result or an error stays whole: copyable, greppable. Tables lay themselves out to the width
# and are printed with ``soft_wrap=False`` (soft wrap would drop their titles' centring).
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
