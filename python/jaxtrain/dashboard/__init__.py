"""``jaxtrain dashboard``: a live web view of run directories (docs/dashboard.md).

``runs`` reads what the page shows from the run directories (never writing to them); ``server``
serves the page and its JSON API on the standard library's HTTP server.
"""

from jaxtrain.dashboard.runs import SourceError, open_source
from jaxtrain.dashboard.server import Dashboard, is_loopback, new_token

__all__ = ["Dashboard", "SourceError", "is_loopback", "new_token", "open_source"]
