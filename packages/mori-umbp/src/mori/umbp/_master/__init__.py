"""The UMBP master (control plane): private modules behind ``mori-umbp-master`` and
:class:`mori.umbp.MasterClient`."""
