"""Integrations with other frameworks, each imported on its own and importing its framework
lazily: ``import graphstash.integrations.transformers`` works without transformers installed
(its functions say what is missing when called)."""
