"""Registered numerical verifications, one module per topic.

Importing a module here registers its checks with :func:`refimpl.verify.register`;
:func:`refimpl.verify.registry` imports them all.
"""
