"""The plan's communication terms: tensor, context and expert parallelism's collectives
per micro-batch, and the bytes each collective kind puts on the wire."""
