"""The one exception base: every exception class vigil defines derives from :class:`VigilError`.

A caller that wants "any failure vigil itself names" catches ``VigilError``; a failure that
is not one (a driver's, the broker client's, a bug) passes through. Classes that also mean a
standard exception keep that base beside this one (``InvalidTimer`` is still a
``ValueError``, ``BlockedAddress`` still an ``httpcore.ConnectError``).

It sits in the bottom layer and imports nothing of vigil's, so any module may use it.
"""

from __future__ import annotations


class VigilError(Exception):
    """Base of vigil's own exceptions."""
