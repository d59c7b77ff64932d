"""int4-stream: group-wise int4 shards laid out to stream one layer or one expert to a device.

The byte layout is specified in docs/formats/int4-stream.md. Importing this package loads no
torch; the modules that need it import it inside their functions.
"""

from gemmactl.formats.int4.layout import QuantizeOptions
from gemmactl.formats.int4.spec import FORMAT_NAME, FORMAT_VERSION, STORE_FORMAT

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "STORE_FORMAT", "QuantizeOptions"]
