"""`stoker-gateway`: the OpenAI-compatible HTTP gateway, its own deployable (the `gateway` extra).

`mapping` turns OpenAI requests into job fields and events into OpenAI responses (pure); `app` is the
Starlette app and the command. Like `client`, it speaks only the wire contract: no engine, no torch.
"""
