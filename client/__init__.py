"""Stoker clients: job producers, event subscribers, the CLI and the OpenAI-style gateway.

Speaks only the wire contract; never imports engine or torch."""
