"""The layout search: measured costs, the model of one layout's step time and memory, and (search.py) the search."""
