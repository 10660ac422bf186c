"""The producer's side of Stoker: the client (job producer, event subscriber), the `stoker` CLI, the load
generator and the demo driver. The OpenAI gateway is its own package (stoker.gateway), the local-stack
launcher too (stoker.devstack).

Speaks only the wire contract; never imports engine or torch."""
