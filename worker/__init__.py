"""The Stoker worker: Kafka in, engine, Redis out (see worker/service.py for the shape)."""
