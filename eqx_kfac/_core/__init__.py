"""Core: dense linear algebra, control flow, device helpers and caching, used by every layer above."""
