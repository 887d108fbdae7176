"""The HTTP surface: the app factory, the OpenAI routes, the admin routes, security and error bodies.

``app.build_app`` assembles the routes over one ``Engine``; ``openai_routes`` and
``admin_routes`` stay thin (validate, go through the engine's gate, stream); ``security``
decides who may talk to the engine; ``errors`` turns every refusal into one answer in
OpenAI's error shape. May import the engine front (``moetray.engine.core`` and the control
operations), fastapi/starlette/pydantic and ``moetray.policy``; never torch directly, never
transformers internals, never the tray.
"""
