/* Runs a Lua 5.4 script file (the luatext and luagc workloads): luaexec SCRIPT. Linked
 * statically at image build time with the Lua sources the compile workload builds. */
#include <stdio.h>
#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: luaexec SCRIPT\n");
        return 2;
    }
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    if (luaL_dofile(L, argv[1]) != LUA_OK) {
        fprintf(stderr, "lua error: %s\n", lua_tostring(L, -1));
        return 1;
    }
    lua_close(L);
    return 0;
}
