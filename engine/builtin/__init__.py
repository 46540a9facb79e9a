"""Small models lorad builds offline: the quickstart's micro LM and the tiny image pipelines."""
