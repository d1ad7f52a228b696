"""The KV memory dock: a registry of pages (registry.py), the Live page, and the Experts, Lengths, Pool, Plan and
quality views with their plain-Python data modules."""
