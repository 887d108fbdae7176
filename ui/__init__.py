"""The dashboard: view models (``viewmodels``, ``pools_model``, ``dashboard_model``) and the
widgets that draw them (``dashboard`` and one ``*_view`` module per panel).

Models take engine snapshots in the :mod:`moetray.policy.wire` shape and emit only on a
real change; widgets subscribe in ``__init__`` and redraw from model state. Nothing here
imports torch or the engine, or talks to the network: the app (:mod:`moetray.app`) owns
the engine client and feeds the models.
"""
