"""Durable files: the crash-safe file layer and the content-keyed cache a home's jobs share."""
