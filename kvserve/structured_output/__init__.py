"""Structured outputs: the sampled text is constrained to a JSON schema, a regex, a choice or a grammar.

grammar.py turns a request's StructuredOutputsParams into an llguidance grammar (and refuses a bad one in the
frontend); matcher.py holds each request's parser state in the engine core, next to the scheduler, and writes
the step's token bitmask that the model runner applies to the logits before sampling.
"""
