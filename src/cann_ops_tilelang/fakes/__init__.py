"""Fake (meta) implementations, one module per op family. They never import TileLang."""
