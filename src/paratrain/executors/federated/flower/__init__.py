"""Federated on Flower's Deployment Runtime (``[federated] runtime = "flower"``): paratrain's
ServerApp (:mod:`.serverapp`, driving paratrain's own round loop, :mod:`.serverloop`) and
ClientApp (:mod:`.clientapp`, the local path's client step on the node's partition,
:mod:`.node`). Only :mod:`.serverapp`, :mod:`.clientapp`, :mod:`.federation` and
:mod:`.secure` import ``flwr`` (the ``flower`` extra). How to run: examples/federated_flower.
"""
