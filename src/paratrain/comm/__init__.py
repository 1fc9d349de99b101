"""The only package that calls torch.distributed: launch, groups, collectives, control plane.

Submodules are imported on use so that ``import paratrain`` stays light.
"""
