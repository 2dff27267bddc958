"""Token-mixing ops of the scan backbones, kept apart from the layers that use them.

Each fast formulation sits next to a plain reference with the same signature; the reference is
the tests' oracle (`wkv.py`: bidirectional WKV for RWKV, `ssd.py`: Mamba-2's SSD scan, `grid.py`:
the 2-D token orders that need the token grid).
"""
