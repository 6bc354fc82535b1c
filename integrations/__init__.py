"""Framework integrations (transformers, Lightning) built on the :mod:`cudnn_attention` core."""
