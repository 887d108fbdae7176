"""The tray process: ``moetray`` with no subcommand.

``main`` (two-phase bootstrap), ``application`` (the one app object: tray, supervisor,
live feed, dashboard), ``supervisor`` (the engine child), ``client`` and ``link`` (the
engine's HTTP API and its event stream), ``tray`` (icon and menu), ``settings``,
``single_instance``, ``autostart`` and ``compat`` (qasync quirks). Never imports torch or
the engine: ``cli`` reaches engine subcommands by module name only.
"""
