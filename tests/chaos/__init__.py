"""The fault-injection campaign of issue 11 (``make chaos``; a bounded run is in ``make test``).

See :mod:`tests.chaos.campaign`.
"""
