"""The family registry: what each model family declares about itself (facts.py), and every family found and the
tables derived from them (families.py). Plain data, no torch; below engine/config, engine/builtin and
engine/families, which all read it. It finds the family packages under engine/families/ by importing them by
name, so it imports none of them in its source."""
