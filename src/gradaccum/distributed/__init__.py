"""Everything that talks to ``torch.distributed``: the collectives, sync deferral, wrapping, counting."""
