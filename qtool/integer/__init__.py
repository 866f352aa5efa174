"""Integer view: a QDQ model read back as integer layers, fixed-point requantization, verify-int.

Imports only the ground, data and table packages.
"""
