"""Model families behind one contract (contract.py), found through registry.py."""
